from services.stage_worker.main import main

main()
