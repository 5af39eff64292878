"""Preemption notices: a checkpoint at the next update when the machine is taken back.

A spot or preemptible VM is told before it is taken back: Compute Engine sends the
guest an ACPI shutdown, whose shutdown ends the processes with SIGTERM, and stops the
VM about 30 s later whatever runs. A checkpoint saved at that notice loses no update
of the run; the periodic ones (`every`) remain for a machine lost without one.

Two sources of the notice, one for each kind of job:

* `SignalNotice`: a process that is the whole job catches SIGTERM itself while a fit
  runs, and, once the checkpoint is written, hands the signal to the handler that
  was there before (by default the process then ends, as it would have at once);
* `ServiceNotice`: the processes of a `jax.distributed` job, where JAX's preemption
  service catches the SIGTERM and agrees with every process on the update at which
  all of them save (a save of split state is collective); each process then exits.

Both keep their state explicit: `reached()` at each update boundary (every process
of a job calls it at the same boundaries), `end_process()` once the save is written,
`close()` at the end of the fit.
"""

from __future__ import annotations

import itertools
import signal
import threading

from keras_tpu_mem._utils import logger

#: The signal of a preemption notice: what a VM's shutdown sends its processes, and
#: what JAX's preemption service listens for.
NOTICE_SIGNAL = signal.SIGTERM

#: The boundaries this process has asked JAX's preemption service about, over all its
#: fits: the service wants the same consecutive numbers from every process of the job.
_SERVICE_CALLS = itertools.count()


def _on_stack(wanted, frame) -> bool:
    while frame is not None:
        if frame is wanted:
            return True
        frame = frame.f_back
    return False


class SignalNotice:
    """SIGTERM caught by this process while a fit runs.

    `start()` installs the handler (main thread only, as Python's signals allow);
    the handler only notes the notice. `reached()` says whether one came;
    `end_process()` puts the previous handler back and raises the signal again for
    it, and, where the process lives on (a handler of the script's own returned, or
    the signal was ignored before), catches the next notice again. A second notice
    before the save is written, or one that comes once `fit_frame` (the loop driving
    the callbacks, e.g. Keras' `fit`) has left the stack without `close()` (a fit
    ended by an error), goes straight to the previous handler.

    Args:
        fit_frame: The frame of the loop that runs the fit's callbacks.
    """

    def __init__(self, fit_frame):
        self._fit_frame = fit_frame
        self._previous = None
        self.received = False

    def start(self) -> str | None:
        """Installs the handler; returns why it cannot (None where installed)."""
        if threading.current_thread() is not threading.main_thread():
            return "this fit runs outside the main thread, where Python cannot catch signals"
        previous = signal.getsignal(NOTICE_SIGNAL)
        if previous is None:
            return ("SIGTERM's handler was installed outside Python (it could not be put "
                    "back)")
        self._previous = previous
        signal.signal(NOTICE_SIGNAL, self._handle)
        return None

    def _handle(self, signum, frame):
        if self.received or not _on_stack(self._fit_frame, frame):
            self._hand_back()
            return
        self.received = True
        logger.warning("ResumableCheckpoint: a preemption notice (SIGTERM): saving at the "
                       "next update boundary, then ending the process.")

    def reached(self) -> bool:
        return self.received

    def _hand_back(self) -> None:
        """The previous handler back in place, and the signal raised again for it."""
        self.close(raise_pending=False)
        signal.raise_signal(NOTICE_SIGNAL)

    def end_process(self) -> None:
        self._hand_back()
        # Still running: the script's own handler returned, or the signal is ignored.
        self.received = False
        self.start()

    def close(self, raise_pending: bool = True) -> None:
        """Puts the previous handler back (the end of a fit); a notice not yet acted on
        (it came after the last update boundary: the epoch-end save holds the fit's
        end) is raised again for it."""
        if self._previous is not None:
            signal.signal(NOTICE_SIGNAL, self._previous)
            self._previous = None
            if raise_pending and self.received:
                self.received = False
                signal.raise_signal(NOTICE_SIGNAL)


class ServiceNotice:
    """JAX's preemption service of a `jax.distributed` job (it catches SIGTERM itself):
    `reached()` is true at the same update boundary on every process, once any of
    them got the notice.

    Args:
        sync_point: `reached(call) -> bool`, the service's sync point
            (`multihost_utils.reached_preemption_sync_point`).
    """

    def __init__(self, sync_point):
        self._sync_point = sync_point

    def reached(self) -> bool:
        return bool(self._sync_point(next(_SERVICE_CALLS)))

    @staticmethod
    def end_process() -> None:
        # The service swallowed the signal: the process ends as SIGTERM would end it.
        raise SystemExit(128 + NOTICE_SIGNAL)

    def close(self) -> None:
        pass


def watch(preemption_sync, fit_frame):
    """The notice source of a fit, started (`preemption_sync`: the backend step's,
    `fit_frame`: the frame of the fit, or None where none was found); None where none
    can be started, with a warning that says why."""
    try:
        sync_point = preemption_sync()
    except RuntimeError as err:
        problem = str(err)
    else:
        if sync_point is not None:
            return ServiceNotice(sync_point)
        if fit_frame is None:
            problem = "the callbacks do not run inside a Keras `fit`"
        else:
            notice = SignalNotice(fit_frame)
            problem = notice.start()
            if problem is None:
                return notice
    logger.warning("ResumableCheckpoint: preemption notices are not saved at: %s. The "
                   "periodic checkpoints (`every`) still are.", problem)
    return None


__all__ = ["NOTICE_SIGNAL", "ServiceNotice", "SignalNotice", "watch"]
