"""Adam (Kingma & Ba 2015, "Adam: A Method for Stochastic Optimization", Algorithm 1), with weight
decay as torch.optim.Adam applies it: an L2 term added to the gradient, which the moments then see.

For each parameter theta with gradient g at step t (t = 1, 2, ...):

    g <- g + lambda * theta                         L2 decay, coupled (AdamW decouples it)
    m <- beta1 * m + (1 - beta1) * g                first moment
    v <- beta2 * v + (1 - beta2) * g^2              second moment
    theta <- theta - lr * m_hat / (sqrt(v_hat) + eps),   m_hat = m / (1 - beta1^t), v_hat = v / (1 - beta2^t)

The code is AdamW's (adamw.py), both of its paths (the loop and foreach), with its
`decoupled_decay` switched off: where AdamW multiplies the parameter by 1 - lr lambda, Adam adds
lambda theta to a copy of the gradient (the stored .grad is left as backward wrote it) and steps on
that. The decay then passes through the adaptive denominator, so a parameter with large gradients is
decayed less: the difference Loshchilov & Hutter (2019, section 2) describe and AdamW removes.
"""

from lmforge.optim.adamw import AdamW


class Adam(AdamW):
    decoupled_decay = False
