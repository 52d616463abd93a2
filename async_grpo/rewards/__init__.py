"""Rewards: answer checks (math-verify), reward plug-ins, shaping, the code sandbox, and the verifier
pool that runs checks in killable processes with a hard deadline.
"""
