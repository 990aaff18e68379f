"""A stand-in for the sglang package in CPU tests (see tests/_fake_sglang/sglang/launch_server.py)."""
