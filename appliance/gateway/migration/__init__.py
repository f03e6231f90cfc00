"""Stream migration: the ledger of what a stream sent (``ledger``) and the hook that continues a broken stream
on another replica (``hook``); settings: ``routing.migration_limit``."""
