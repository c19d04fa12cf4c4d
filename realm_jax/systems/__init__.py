"""What training and evaluation share, below both: the open-QA system and the runs' checkpoints."""
