"""The composition layer: the only modules below the composition root (appliance/app.py, serve.py, the command
line) that read several sections of the settings at once.

Each package owns its own section and reads nothing else of the settings: its builders take that section and the
plain values they need (a model path, a port, a token). Something has to read the sections side by side and hand
those values over (the fleet plan needs the engine section and the replica count, device and state folder;
maintenance needs the gateway's drain timeout and the collectors' statistics folder; the monitoring bundle needs
the gateway's tokens). Doing it in the packages would make them import the root ``appliance.settings.Settings``,
which composes their own sections: an import pointing back up. So it is done here, above the packages and below
the root, one module per part: ``fleet`` (the supervisor, discovery, the engines' specs), ``maintenance``
(the maintenance service and its reload), ``monitoring`` (the bundle and the local Prometheus and Alertmanager).

This ``__init__`` imports none of them: ``appliance monitoring-config`` (compose's init container, without the
engine stack) imports ``composition.monitoring`` alone.
"""
