"""Helpers shared by test folders, written once: free ports (ports.py) and the tiny vision set-up (vision.py)."""
