"""Few-step distillation's math, beside ``diffusion/``: the student's schedule and sampler
(``schedule.py``) and distribution matching (``dmd.py``). The training step that runs the
roles (student, critic, teacher) is ``train/dmd2.py``."""
