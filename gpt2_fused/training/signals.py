"""Stopping a run cleanly on SIGTERM or Ctrl-C."""

import os
import signal
import sys


class StopFlag:
    """SIGTERM/SIGINT set a flag: the loop finishes its step, saves and exits (under DDP after one
    or two more steps: the ranks agree through the flag in each step's all-reduce, read one step
    late). A second Ctrl-C kills at once; repeated SIGTERMs (a launcher forwarding one) only set
    the flag again. install() and restore() put it in place and take it out."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, announce=True):
        self.announce = announce  # print the message (rank 0 under torchrun: one line, not W)
        self.requested = False
        self.seen = set()
        self.old = {}

    def install(self):
        self.old = {s: signal.signal(s, self) for s in self.SIGNALS}
        return self

    def restore(self):
        for s, h in self.old.items():
            signal.signal(s, h)
        self.old = {}

    def __call__(self, signum, frame):
        if signum == signal.SIGINT and signum in self.seen:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        self.requested = True
        self.seen.add(signum)
        msg = f"signal {signum}: finishing this step, saving a checkpoint, exiting"
        if signum == signal.SIGINT:  # the kill can land mid-save: that checkpoint is lost
            msg += " (Ctrl-C again: stop at once, without saving)"
        msg += "\n"
        if not self.announce:
            return
        try:  # os.write, not print: the handler may have interrupted a print (not re-entrant)
            os.write(sys.stdout.fileno(), msg.encode())
        except OSError:  # a closed stdout: the stop goes on without the message
            pass
