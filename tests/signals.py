"""Children whose SIGINT a test relies on (a Ctrl-C the test sends) start with SIGINT's default
disposition: a job launched in the background (`bash scripts/test.sh &`, nohup, some CI runners)
inherits SIGINT as *ignored*, a child inherits that through exec, and Python then installs no
KeyboardInterrupt handler, so the test's Ctrl-C would never arrive."""
import signal


def default_sigint() -> None:
    """preexec_fn for subprocess.Popen: SIGINT (and SIGQUIT) back to their default disposition in the child."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGQUIT, signal.SIG_DFL)
