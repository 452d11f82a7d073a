"""On-policy knowledge distillation with TRL's script arguments: TRL's trl/scripts/distillation.py on hfnative.

The shipped tiny student learns the shipped teacher's next-token distributions on its own completions of the
shipped prompts (CPU, seconds):

    python examples/distillation.py \
        --model_name_or_path examples/tiny-qwen3 \
        --teacher_model_name_or_path examples/tiny-qwen3-teacher \
        --dataset_name examples/data/sft_prompt_completion.jsonl \
        --max_completion_length 32 --learning_rate 1e-3 --max_steps 20 \
        --use_cpu --bf16 false --report_to none --output_dir outputs/tiny-qwen3-distillation

LoRA: add --use_peft --lora_r 8 (any TRL flag works). The "completion" column of that file is not read: the
student writes its own completions. Swapping the import below for ``from trl import DistillationConfig,
DistillationTrainer`` runs the same script on TRL.
"""

from hfnative import DistillationConfig, DistillationTrainer
from hfnative.trainers.running.cli import TrainingArgumentParser
from hfnative.trainers.running.script_arguments import (
    ModelArguments,
    ScriptArguments,
    model_init_kwargs_from,
    peft_config_from,
    train_and_eval_datasets,
)


def main(script_args, training_args, model_args):
    if training_args.teacher_model_name_or_path is None:
        raise ValueError("A teacher model is required for distillation training. Set it with `--teacher_model_name_or_path`.")
    training_args.model_init_kwargs = model_init_kwargs_from(model_args, training_args)
    train_dataset, eval_dataset = train_and_eval_datasets(script_args, training_args)

    trainer = DistillationTrainer(
        model=model_args.model_name_or_path,
        teacher_model=training_args.teacher_model_name_or_path,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        peft_config=peft_config_from(model_args),
    )
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)

    trainer.save_model(training_args.output_dir)
    print(f"Model saved to {training_args.output_dir}")
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=script_args.dataset_name)
        print(f"Model pushed to the Hub as {trainer.hub_model_id}")


if __name__ == "__main__":
    parser = TrainingArgumentParser((ScriptArguments, DistillationConfig, ModelArguments))
    main(*parser.parse_args_and_config())
