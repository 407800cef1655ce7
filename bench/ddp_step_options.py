"""The options torch_ddp_peer.py and libtorch_compare.py share (libtorch_fsdp_step
takes the same flags), so that both peers run the model, batch and steps the
comparison asks for."""


def add_step_options(p):
    """--ranks (repeatable; 1, 2 and 4 when none), --steps, --batch, --hidden."""
    p.add_argument("--ranks", type=int, action="append")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--hidden", type=int, default=1024)


def world_sizes(a):
    return a.ranks or [1, 2, 4]


def step_flags(a, n):
    """The command-line flags that run one peer at n ranks with a's options."""
    return ["--ranks", str(n), "--steps", str(a.steps), "--batch", str(a.batch), "--hidden", str(a.hidden)]
