"""In-job runtime: rank bootstrap (mpi4py -> torch.distributed) and the TP/PP/DP layout.

    env = init_distributed()                       # bootstrap.py
    pctx = initialize_model_parallel(env, tp, pp)  # layout.py
    with pctx.generation_layout(refold=True) as gl:
        ...                                        # build generation data loaders here
    pctx.destroy(); shutdown_distributed(env)
"""
