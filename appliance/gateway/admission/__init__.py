"""Admission: the adaptive concurrency limit per replica (``limit``), the bounded queue with fair share that
waits for room under it (``queue``), and the slot leases it hands out (``slots``); settings: ``admission``."""
