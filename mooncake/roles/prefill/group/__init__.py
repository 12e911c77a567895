"""A prefill pipeline group: stage 0 (the leader) sends each chunk's activations to
the later stages over authenticated links.

- `pipeline`    several prompts in flight over the stages (`send_prompt`, `Answers`)
- `link`, `listener`, `auth`   stage-to-stage frames, where a stage accepts, the handshake
- `stage`, `stageproc`   a later stage's loop, and that stage as a process
- `leaderlink`  the leader's link to stage 1 as the node sees it (lost: tell the master)
"""
