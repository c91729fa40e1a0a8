"""Auditing a job's recorded history with the services' own pure cores.

- verify.py: re-fold the recorded inputs through every core and check each recorded decision is reproduced
  exactly, none missing and none extra (`flightdeck verify`).
- simulate.py / whatif.py: fold the same inputs with the job's policy changed, all cores together, and show
  which decisions change and what that would have cost or saved (`flightdeck whatif`).
"""
