"""Developer tools shipped with lmdeploy (tiny test checkpoints); nothing here is imported by the engine."""
