"""A reward function whose module imports slowly (like reasoning-gym's, seconds): the import must
not count against the call's deadline."""

import time

time.sleep(2.0)
VALUE = 1.0


def score(prompt, completion, token_ids, metadata):
    return VALUE
