from worker.serve.server import main

main()
