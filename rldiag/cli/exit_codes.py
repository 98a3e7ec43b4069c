"""The exit codes of ``rldiag``: one table for every command.

====  ================  ============================================================================
code  name              meaning
====  ================  ============================================================================
0     ``OK``            the command did what was asked, and its answer is "all is well": ``check``
                        found no problem, ``recompute`` wrote every step, ``verify`` matched,
                        ``doctor`` found nothing, ``import-wandb`` wrote the import,
                        ``layout-audit`` wrote the audit, ``rows`` printed the rows, ``rescore`` wrote
                        every step, ``probe-reward`` found no shortcut;
                        ``doctor --follow`` ended by its idle timeout (its events were the answer)
1     ``FAILED``        the answer is "no": ``check`` found problems, ``recompute`` or ``rescore`` has
                        failed steps (the others are written), ``verify`` found a mismatch, ``doctor`` a
                        finding, ``probe-reward`` a shortcut. Also: an error stopped a command (``Type: message`` on stderr),
                        for every command but ``verify`` and ``doctor`` (see ``CANNOT_CHECK``)
2     ``CANNOT_CHECK``  the command line is wrong (argparse's own code, or no command given); or
                        ``verify`` / ``doctor`` could not check the run at all (an unreadable run,
                        config or rules file, missing columns): for these two, 1 would read as a
                        mismatch or a finding
3     ``INTERNAL``      a bug in rldiag: an exception it did not mean to raise (``rldiag: internal error``
                        and its traceback on stderr, with a request to report it); for ``recompute``,
                        a step a bug failed (the other steps are written)
130   ``INTERRUPTED``   Ctrl-C (how ``doctor --follow`` ends when it has no idle timeout)
====  ================  ============================================================================

:data:`ERROR_EXIT` says which code an error (:class:`~rldiag.errors.RldiagError`) gives, by command;
:func:`rldiag.cli.main.main` applies it, so that no command maps errors on its own.
"""

from __future__ import annotations

OK = 0
FAILED = 1
CANNOT_CHECK = 2
INTERNAL = 3
INTERRUPTED = 130

#: exit code of an error, by command name (the others: FAILED)
ERROR_EXIT = {"verify": CANNOT_CHECK, "doctor": CANNOT_CHECK}

#: ``rldiag verify``'s code for each status of its report (``VerifyReport.status``)
VERIFY_STATUS_EXIT = {"match": OK, "mismatch": FAILED, "unverifiable": CANNOT_CHECK}


def error_exit(command: str | None) -> int:
    """The exit code of an error that stopped ``command``."""
    return ERROR_EXIT.get(command or "", FAILED)
