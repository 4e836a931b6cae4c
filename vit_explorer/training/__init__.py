"""Training, from one loop to runs a shared server queues. Imports run one way, down this list:

    runs.py         the runs on a runs folder every server shares: queue, owners, stop, rediscovery
    run.py          TrainingRun: the loop on a thread or in a process of its own, its event log
    admission.py    whether a run fits, from its config alone (memory estimate, Limits, RunRefused);
                    the memory a run's or a job's process keeps to
    evaluation.py   a trained model tested afterwards (another patch or image size, several sizes)
    train.py        the loop: a generator of events, checkpoints and their sidecar, model_config
    priority.py     a run's or a job's process below the app servers (nice 15, its autogroup too)
    pace.py         how long is left of a run or a job, from its share done, and in words
"""
