"""The plan of declarations: what a topology needs on the broker, how that compares with
what is there, and the programs that declare it. Pure: the transports execute, this
package decides. One module a job, each importing only those below it:

    desired      what a topology needs: exchanges, queues, bindings and their arguments
       ^
       +-- diff        compared with what the broker has (its per-version defaults):
       |       ^       a plan of changes (create, in place, conflict, extra...)
       +-- refusals    what the broker refuses: a version that cannot hold the
       |       ^       topology, a 406 read back as a conflict, a missing plugin
       |       |
    program      the sans-I/O declare and plan programs, their operations, and what
                 each answer (or refusal) from the broker means
    permissions  the RabbitMQ permissions each role needs (reads `desired` only)

`diff` and `refusals` do not import each other; `program` imports all three.
"""
