"""The ``rldiag`` command line."""
