"""The launcher: command line, options, the per-node agent, its children and control channel.

Runs on every node before and around the training processes. It never imports
TensorFlow, the trainers or the script-side helpers (cluster(), strategy(), fit()).
"""
