"""Pure policy-gradient maths beside the loss: advantage estimators and the batcher's prepare hook
(KL in the reward, its controller, user functions).
"""
