"""Processes (the bottom layer): process groups and the all-reduce every decision goes through
(``distributed``), the local launcher and its one-line error reports (``launcher``), Ctrl-C and SIGTERM as
stop requests (``signals``). Imports nothing else of syncwise."""
