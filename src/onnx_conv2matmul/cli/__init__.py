"""The command line: parse flags into options, call the API, render reports, own signals and exit codes.

May import everything below it; nothing in the library imports it.
"""
