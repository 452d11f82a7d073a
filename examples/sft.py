"""Supervised fine-tuning with TRL's script arguments: TRL's trl/scripts/sft.py on hfnative.

Full fine-tuning of the shipped tiny model on the shipped data (CPU, under a minute):

    python examples/sft.py --config examples/sft_full.yaml

LoRA (or any TRL flag; command-line flags override the YAML):

    python examples/sft.py --config examples/sft_lora.yaml --lora_r 8

Swapping the import below for ``from trl import SFTConfig, SFTTrainer`` runs the same script on TRL
and writes an output folder with the same files.
"""

from hfnative import SFTConfig, SFTTrainer
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

    trainer = SFTTrainer(
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
    parser = TrainingArgumentParser((ScriptArguments, SFTConfig, ModelArguments))
    main(*parser.parse_args_and_config())
