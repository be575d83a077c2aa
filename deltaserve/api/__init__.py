"""Stage package: api."""
