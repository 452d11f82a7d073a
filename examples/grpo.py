"""Group Relative Policy Optimization with TRL's script arguments: TRL's trl/scripts/grpo.py on hfnative.

The shipped tiny model on the shipped prompts, rewarded by a built-in and a function of this file
(CPU, seconds):

    python examples/grpo.py --model_name_or_path examples/tiny-qwen3 \
        --dataset_name examples/data/sft_prompt_completion.jsonl --output_dir grpo-tiny --use_cpu --no_bf16 \
        --reward_funcs examples.grpo.letter_e think_format_reward --max_steps 20 --learning_rate 1e-2 \
        --per_device_train_batch_size 16 --num_generations 8 --max_completion_length 16 --logging_steps 5

``--reward_funcs`` takes built-in names (exact_match, think_format_reward, get_soft_overlong_punishment,
completion_length) and dotted import paths; ``--reward_model_name_or_path`` adds a sequence-classification
reward model. LoRA: ``--use_peft --lora_r 8``. Swapping the import below for ``from trl import GRPOConfig,
GRPOTrainer`` (and TRL's script arguments) runs the same script on TRL.
"""

from hfnative import GRPOConfig, GRPOTrainer
from hfnative.trainers.running.cli import TrainingArgumentParser
from hfnative.trainers.algorithms.grpo import RLScriptArguments, rl_trainer_kwargs
from hfnative.trainers.running.script_arguments import (
    ModelArguments,
    model_init_kwargs_from,
    peft_config_from,
    train_and_eval_datasets,
)


def letter_e(completions, **kwargs) -> list[float]:
    """A toy verifiable reward: the fraction of the letter "e" in the completion."""
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [t.count("e") / max(len(t), 1) for t in texts]


def main(script_args, training_args, model_args):
    training_args.model_init_kwargs = model_init_kwargs_from(model_args, training_args)
    train_dataset, eval_dataset = train_and_eval_datasets(script_args, training_args)

    trainer = GRPOTrainer(
        model=model_args.model_name_or_path,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        peft_config=peft_config_from(model_args),
        **rl_trainer_kwargs(script_args, training_args, model_args),
    )
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)

    trainer.save_model(training_args.output_dir)
    print(f"Model saved to {training_args.output_dir}")
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=script_args.dataset_name)
        print(f"Model pushed to the Hub as {trainer.hub_model_id}")


if __name__ == "__main__":
    parser = TrainingArgumentParser((RLScriptArguments, GRPOConfig, ModelArguments))
    main(*parser.parse_args_and_config())
