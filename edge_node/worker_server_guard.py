"""Imported first by the worker server (`edge_node.worker_process.PRELOAD`): the server dies with the
process that started it.

Without it the server notices its starter gone only through its "a client is alive" pipe, after
its own imports, and then exits through a whole interpreter shutdown with torch loaded, seconds in
which its workers (which die with it) go on. PR_SET_PDEATHSIG fires when the starter's thread that
started the server ends: `xronos run`, the bench and the node agent start it from their main thread.
"""

from edge_node.worker_process import die_with_parent

die_with_parent()
