"""The package's version, in a module of its own: the server and its fingerprint read it without importing the
package's namespace (deltaserve/__init__.py), which imports the offline API (tests/test_imports.py: no cycle)."""

__version__ = "0.1.0"
