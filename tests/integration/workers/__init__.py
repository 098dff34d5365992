"""Helpers for the worker tests: an in-process harness and apps run as subprocesses."""
