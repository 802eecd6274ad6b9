"""pytorch package."""
