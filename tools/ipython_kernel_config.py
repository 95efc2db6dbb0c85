"""IPython kernel configuration that `make install-test` copies into the venv
(``.venv/etc/ipython/``, read by every kernel started from this venv: nbval's,
nbconvert's, JupyterLab's).

Kernels started on this machine talk to their client over loopback TCP, and
ipykernel warns on every start that the channel is unencrypted. nbval and
nbconvert start a kernel per notebook, so the warning filled the test log;
the connection never leaves the machine, so this filter drops that one
message (and nothing else).
"""
import logging


class _DropUnencryptedTcpWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "running over TCP without encryption" not in record.getMessage()


logging.getLogger("IPKernelApp").addFilter(_DropUnencryptedTcpWarning())
