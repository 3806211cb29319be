"""The daemon's endpoints, one family per module; app.py puts them together."""
