"""tierckpt-sagemaker-alias: not imported by name. This directory goes on sys.path (last, through
``tierckpt-sagemaker-alias.pth``) so that ``amzn_sagemaker_checkpointing`` resolves to tierckpt's
alias package inside it only when Amazon's package is not installed."""
