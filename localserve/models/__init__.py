"""The models: which are served (registry), each one's engine host, their files and memory."""
