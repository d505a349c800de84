"""What each evaluation of a run measures: the validation loss, the mean loss over a fixed set of
validation batches; and, with train.eval_tasks, benchmark scores on a fixed set of questions."""

import time

import torch
import torch.distributed as dist

from lmforge.common.errors import LmforgeError
from lmforge.config import Config
from lmforge.data.loader import window_batch
from lmforge.eval.metrics import aggregate, question_row, summarise
from lmforge.eval.score import score_questions
from lmforge.eval.tasks import GENERATION, TITLES, expand_tasks, load_questions
from lmforge.model.transformer import Transformer
from lmforge.modes import Policy
from lmforge.parallel.parallelize import Engine
from lmforge.parallel.world import World
from lmforge.precision.policy import autocast
from lmforge.runs.state import TARGET_REACHED


@torch.no_grad()
def evaluate(model: Transformer, tokens, batch_size: int, seq_len: int, seed: int, batches: int,
             device: torch.device, policy: Policy, world: World = World(),
             make_batch=window_batch, engine: Engine | None = None, stopping=None) -> float | None:
    """Mean loss over a fixed set of `batches` batches (the same ones at every evaluation),
    computed as training computes it (under the forward autocast of `policy`); `make_batch`
    draws them (windows, or fine-tuning examples: data/sft.py's example_batch). Each replica takes
    its rows of the global batches and the means are averaged over the ranks: N ranks of
    batch_size B evaluate what one process of N*B does. With an `engine`, its `eval_loss` runs the
    forward (a pipeline's goes through every stage) and its replicas share the batches.
    `stopping()`, asked before each batch (every rank asks: it may be a collective), returns a stop
    request or None: on a request the evaluation is abandoned and None returned."""
    was_training = model.training
    model.eval()
    losses = []
    replica, replicas = (engine.replica, engine.replicas) if engine is not None else (world.rank, world.world_size)
    loss_of = engine.eval_loss if engine is not None else model
    for index in range(batches):
        if stopping is not None and stopping() is not None:
            break
        x, y = make_batch(tokens, batch_size, seq_len, seed, index, rank=replica, world_size=replicas)
        with autocast(policy, device):
            losses.append(loss_of(x.to(device), y.to(device)).item())
    model.train(was_training)
    if len(losses) < batches:  # stopped: every rank at the same batch
        return None
    return world.mean(sum(losses) / len(losses))


class EvalTasks:
    """train.eval_tasks: the first train.eval_items questions of each multiple-choice task, read once
    before training starts (a bad name, or the task data missing, stops the run there in one line),
    then scored at each evaluation as `lmforge eval` scores them (eval/score.py, eval/metrics.py).

    Under torchrun the questions are dealt out over the data-parallel replicas (question i to
    replica i mod N), each scoring on its own whole model (config/rules.py refuses a strategy
    that splits it), and the per-question rows are gathered and summarised in question order: the
    numbers one process gives on the same weights, bit for bit. A failure while scoring (on any
    rank) is one warning line and no scores for that evaluation; training goes on."""

    def __init__(self, cfg: Config):
        names = [name for name in cfg.train.eval_tasks.split(",") if name.strip()]
        try:
            tasks = expand_tasks(names)
            generation = [task for task in tasks if task in GENERATION]
            if generation:
                raise LmforgeError(f"{', '.join(generation)} generate answers, too slow to score at each "
                                   f"evaluation: give multiple-choice tasks (the core suite), and score "
                                   f"generation with lmforge eval on a checkpoint")
            # without the task data installed, load_questions says what to install (eval/tasks.py's data_root)
            self.questions = {task: load_questions(task, "rc", None, cfg.train.eval_items) for task in tasks}
        except LmforgeError as err:
            raise LmforgeError(f"train.eval_tasks={cfg.train.eval_tasks}: {err}") from None
        self.end_token = cfg.data.end_token

    def score(self, model, tokenizer, device: torch.device, policy: Policy, world: World, replica: int = 0,
              replicas: int = 1, warn=print) -> dict | None:
        """{task: metrics.summarise's means, "aggregate": {"centered": the CORE-style mean}}, the same
        on every rank; None (and one `warn` line) if scoring failed on any rank."""
        end_id = tokenizer.token_to_id(self.end_token)
        rows, error = {}, None
        was_training = model.training
        model.eval()
        try:
            with autocast(policy, device):
                for task, questions in self.questions.items():
                    mine = range(replica, len(questions), replicas)  # batched as lmforge eval batches them
                    pairs = [(questions[i].contexts, questions[i].continuations) for i in mine]
                    for index, (scored, cut) in zip(mine, score_questions(model, tokenizer, pairs, end_id)):
                        q = questions[index]
                        rows[task, index] = {**question_row(scored, q.continuations, q.gold), "truncated": cut}
        except Exception as err:  # the run goes on: this evaluation has no task scores
            error = f"{type(err).__name__}: {err}"
        finally:
            model.train(was_training)
        shares = [(rows, error)]
        if world.distributed:  # every rank's rows (and errors) to every rank
            shares = [None] * world.world_size
            dist.all_gather_object(shares, (rows, error))
        errors = [f"rank {rank}: {e}" if len(shares) > 1 else e for rank, (_, e) in enumerate(shares) if e]
        if errors:
            warn(f"warning: train.eval_tasks not scored at this evaluation ({errors[0]})")
            return None
        every = {key: row for share, _ in shares for key, row in share.items()}
        scores = {}
        for task, questions in self.questions.items():
            ordered = [every[task, index] for index in range(len(questions))]
            scores[task] = summarise(ordered, sum(row["truncated"] for row in ordered))
        return {**scores, "aggregate": {"centered": aggregate(scores)}}


def run_evaluation(trainer, stopping) -> bool:
    """A Trainer's evaluation (train/loop.py): the validation loss and train.eval_tasks' scores,
    logged and kept in its run state's history (the summary shows the last). Returns whether the
    loss reached train.target_loss (then TARGET_REACHED is in the history: the run ends). A stop
    request (`stopping`, see evaluate) ends it between two batches, with no validation loss kept."""
    t, state, log = trainer.cfg.train, trainer.state, trainer.log
    seed = t.seed + 1 if t.eval_seed is None else t.eval_seed
    val_loss = evaluate(trainer.model, trainer.data.val, t.eval_batch_size or t.batch_size, trainer.cfg.seq_len,
                        seed, t.eval_batches, trainer.device, trainer.policy, trainer.world, trainer.make_batch,
                        engine=trainer.engine, stopping=stopping)
    if val_loss is None:
        state.history.pop("val_loss", None)
        return False
    state.history["val_loss"] = val_loss
    tasks, engine = trainer.eval_tasks, trainer.engine
    scores = tasks and tasks.score(trainer.model, trainer.data.tokenizer, trainer.device, trainer.policy,
                                   trainer.world, engine.replica, engine.replicas, log.note)
    if scores:
        state.history["eval_tasks"] = scores
    log.record({"step": state.step, "val_loss": val_loss, **(task_fields(scores) if scores else {}),
                "time": time.time()})
    log.note(evaluation_line(state.step, val_loss, scores))
    target = t.target_loss
    if target is None or val_loss > target:
        return False
    state.history[TARGET_REACHED] = {"step": state.step, "target_loss": target}
    log.note(f"step {state.step}: target reached (val loss {val_loss:.4f} <= train.target_loss={target:g})")
    return True


def task_fields(scores: dict) -> dict:
    """The metrics record's fields of EvalTasks.score's scores: eval/TASK/acc, ..., eval/aggregate/centered."""
    return {f"eval/{task}/{key}": value for task, means in scores.items() for key, value in means.items()
            if key in ("acc", "acc_norm", "bpb", "centered")}


def evaluation_line(step: int, val_loss: float, scores: dict | None) -> str:
    """The line printed after an evaluation (`lmforge report` lists them from metrics.jsonl)."""
    return f"step {step}: val loss {val_loss:.4f}" + (f" | {task_line(scores)}" if scores else "")


def record_scores(record: dict) -> dict | None:
    """The scores an evaluation's metrics record holds (task_fields read back); None without any."""
    scores = {}
    for key, value in record.items():
        if key.startswith("eval/"):
            _, task, name = key.split("/", 2)
            scores.setdefault(task, {})[name] = value
    return scores or None


def task_line(scores: dict) -> str:
    """The scores as the line printed after an evaluation's validation loss."""
    parts = [f"{TITLES[task]} acc_norm {means['acc_norm']:.3f}" for task, means in scores.items() if task in TITLES]
    return " | ".join([*parts, f"centered {scores['aggregate']['centered']:+.3f}"])


def task_rows(scores: dict) -> list[tuple[str, str]]:
    """The end-of-run summary's rows of the last evaluation's scores."""
    rows = [(f"{TITLES[task]} ({means['items']} questions)", f"acc {means['acc']:.3f}, acc_norm "
             f"{means['acc_norm']:.3f}, {means['bpb']:.3f} bits/byte") for task, means in scores.items()
            if task in TITLES]
    return [*rows, ("eval tasks, centered aggregate", f"{scores['aggregate']['centered']:+.4f}")]
