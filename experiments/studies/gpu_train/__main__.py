from experiments.studies.gpu_train.run import main

main()
