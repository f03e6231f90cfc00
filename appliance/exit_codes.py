"""The exit codes of every ``appliance`` command, in one place, so scripts and runbooks can rely on them."""

EXIT_OK = 0
EXIT_FAILED = 1  # the command ran and the answer is no (a failed check, an unreachable appliance, a bad verdict)
EXIT_USAGE = 2  # the command line or the configuration is wrong: nothing was done
EXIT_INTERRUPTED = 130  # Ctrl-C
