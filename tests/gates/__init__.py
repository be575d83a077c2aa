"""Gate tests: the token and media gates, `deltaserve check all` and oracle-flags, on fakes and tiny models."""
