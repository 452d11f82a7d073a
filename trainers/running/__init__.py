"""Running a training: the CLI, launching processes, the process group and layout, loading models, checking settings, the Hub."""
