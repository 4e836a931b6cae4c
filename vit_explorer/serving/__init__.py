"""Serving a class: what lets one machine's app servers share work and memory safely.

    jobs.py        a view's heavy computation as a job: admitted, queued on a folder every server
                   shares, run in a worker process, followed through files (JobBoard)
    job_kinds.py   what each kind of job computes, and its cost estimated before it is admitted
    replicas.py    vit-explorer serve: several app servers behind nginx, sticky sessions
    cache.py       ByteBoundedCache (shared values, bounded in bytes); a folder trimmed to a quota
"""
