"""Reporting: events with their text, the tally, report files and reading them back, the exit diagnostics.

Imports nothing of the rooms above it (activation, the guard, engines, the protected
set); torch-free.
"""
