"""The archiver: each job's telemetry and output copied to the object store before the streams age them out."""
