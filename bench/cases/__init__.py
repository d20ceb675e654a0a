"""One module per measurement: serve, epoch, load, memory."""
