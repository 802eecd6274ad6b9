"""paging package."""
