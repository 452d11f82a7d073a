"""Direct Preference Optimization with TRL's script arguments: TRL's trl/scripts/dpo.py on hfnative.

Full fine-tuning of the shipped tiny model on the shipped preference data (CPU, seconds):

    python examples/dpo.py --model_name_or_path examples/tiny-qwen3 \
        --dataset_name examples/data/preference.jsonl --output_dir dpo-tiny --use_cpu --no_bf16 \
        --max_steps 20 --learning_rate 1e-4 --per_device_train_batch_size 4 --logging_steps 5

LoRA (the reference is then the base model with the adapter disabled; no second copy):

    python examples/dpo.py ... --use_peft --lora_r 8 --lora_target_modules q_proj v_proj

Swapping the import below for ``from trl import DPOConfig, DPOTrainer`` runs the same script on TRL
and writes an output folder with the same files.
"""

from hfnative import DPOConfig, DPOTrainer
from hfnative.trainers.running.cli import TrainingArgumentParser
from hfnative.trainers.running.script_arguments import (
    ModelArguments,
    ScriptArguments,
    model_init_kwargs_from,
    peft_config_from,
    train_and_eval_datasets,
)


def main(script_args, training_args, model_args):
    training_args.model_init_kwargs = model_init_kwargs_from(model_args, training_args)
    train_dataset, eval_dataset = train_and_eval_datasets(script_args, training_args)

    trainer = DPOTrainer(
        model=model_args.model_name_or_path,
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
    parser = TrainingArgumentParser((ScriptArguments, DPOConfig, ModelArguments))
    main(*parser.parse_args_and_config())
