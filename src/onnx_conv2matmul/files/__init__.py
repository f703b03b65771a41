"""Files: load models and their external data, write outputs through staging, lock, journal and recovery.

The only code that opens, writes or renames files; may import ``errors`` and ``_graphs`` only.
"""
