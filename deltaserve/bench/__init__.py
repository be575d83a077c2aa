"""The benchmark harness: the client (`serve_cli`), the grid, the report, and the oracle registry.

Speed claims are only ratios against a peer engine measured in the same grid with the same client; the peer's
command line always comes from `registry`, and `deltaserve check oracle-flags` guards hand-written launches.
"""
