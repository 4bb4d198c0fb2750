"""Several front-end (HTTP) processes in front of one engine core: `loraserve serve --api-server-count N`.

`supervisor` is the main process: it binds the listening sockets, starts the engine core and N
front-end processes (`worker`), watches them, and forwards SIGTERM. `role` is what a server process
does differently when it is one front end of several (engine connection, shared counters, metrics,
config events). `runtime` is the folder the processes of one server share; `placement` picks how many
front ends and where the engine core runs; `peer_events` carries config changes between front ends.
docs/PROCESSES.md has the picture.
"""
