"""Hand-off: a finished run in the layout of the trainer or server the user deploys with.

speculators.py and specforge.py say what each consumer reads (pure: names, records, commands);
export.py is the shell that reads the run, writes the export atomically and checks it.
"""
