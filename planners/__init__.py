"""Standard planners: dedup + balanced writes on save, box intersection on load."""
