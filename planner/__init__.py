"""Capacity planning: what a worker's steps cost on a machine (profile.py), for the
simulator and the planner built on it."""
