"""openai package."""
